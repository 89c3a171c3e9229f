"""Other libraries' checkpoints and files: Orbax, safetensors; import and export."""
