"""GGUF checkpoints (llama.cpp's format), read with the `gguf` library and turned into an
ordinary Hugging Face checkpoint directory that the rest of pipeserve loads as any other.

- config.py: the architecture config from the file's metadata
- tensors.py: llama.cpp tensor names to Hugging Face ones, dequantisation, the Q/K
  row order llama.cpp uses for Llama models undone
- vocab.py: the tokenizer (`tokenizer.ggml.*`) as a `tokenizers` tokenizer, with the
  pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre`
- convert.py: `pipeserve convert GGUF OUT_DIR`, and the converted copy `Engine("x.gguf")`
  loads (made once, cached)
"""

from pipeserve.models.gguf.convert import convert, converted_checkpoint, find_gguf

__all__ = ["convert", "converted_checkpoint", "find_gguf"]
