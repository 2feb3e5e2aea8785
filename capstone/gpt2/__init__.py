"""Weights and tokens in and out of a run: a Hugging Face GPT-2 directory (hf), a run that starts
from other weights (finetune), the tokenizer that decodes a checkpoint (vocab), decoding (generate)."""
