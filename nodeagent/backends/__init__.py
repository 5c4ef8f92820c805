"""Backends: llama.cpp everywhere, MLX on Apple Silicon. Heavy libraries are imported lazily."""
