"""tilec generates no more kernels than Inductor for a transformer block.

Inductor compiles cold here (its caches are off), which takes ~20 s on a CPU.
"""

from __future__ import annotations

from benchmarks.kernel_count import block_and_input, inductor_kernel_counts, tilec_kernel_count


def test_block_needs_no_more_kernels_than_inductor():
    block, x = block_and_input()
    ours = tilec_kernel_count(block, x)
    generated, functions = inductor_kernel_counts(block, x)
    assert 0 < functions <= generated
    # Inductor's kernel functions are what it launches: the like-for-like count.
    assert ours <= functions, f"tilec {ours} kernels, Inductor {functions}"
