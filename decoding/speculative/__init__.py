"""Speculative decoding: drafters propose, the target verifies in one pass, losslessly."""
