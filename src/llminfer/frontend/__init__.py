"""The front end: request input (validate, tokenize) and output (detokenize, stop strings, handles)."""
