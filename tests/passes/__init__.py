"""Tests of capture, the pass manager and each graph pass."""
