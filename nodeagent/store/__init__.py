"""Model acquisition, one room: the catalog (``models/*.toml``), the local store (files already on
disk, pulls), the Hugging Face hub (range-read headers, downloads) and the package index (the test
models). Nothing here loads a model; it finds, fetches and describes files."""
