"""Text and tokens: the tokenizer with its chat template, and incremental detokenization with stop strings."""
