"""Text handling: the tokenizer (`tokenizer`, its GGUF chat templates `chat_templates`, the
token-id-only `null_tokenizer`), incremental detokenization (`detokenizer`) and the check of
text UTF-8 cannot encode (`unicode_text`)."""
