"""Graph -> Graph passes; their order lives in ``tilec.pipeline``."""
