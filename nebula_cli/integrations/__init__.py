"""Ways into nebula's runtime from frameworks, said in code (the automatic hook says it for
unmodified scripts): `hf` for the Hugging Face Trainer."""
