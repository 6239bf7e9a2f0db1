"""Training text: tokenising files into a memory-mapped token file (`prepare`) and the
fixed-length windows each data-parallel rank reads (`data`)."""
