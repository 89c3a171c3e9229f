"""The on-disk format, pure: names, the tree record, the chunk codec, zarr.json documents, data types, records."""
