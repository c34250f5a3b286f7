"""flashkiln.generator: YAML specs -> rendered CUDA C++ -> NVRTC cubins + manifest (no GPU needed)."""

GENERATOR_VERSION = "0.1.0"
