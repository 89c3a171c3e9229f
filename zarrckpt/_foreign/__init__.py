"""Other libraries' checkpoints and files: Orbax, safetensors; import and export."""

EXPORT_FORMATS = ("npz", "safetensors")  # export's, here for the command line, which imports no JAX
