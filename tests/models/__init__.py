"""Tests of model intake: presets and the loader."""
