"""Chunk-size selection: measured tiles, P:D-aware recommendation, adaptive C."""
