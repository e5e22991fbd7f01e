"""The OpenAI-compatible HTTP server and `core-serve`: the FastAPI app and its routes
(`app`), the completions and chat handlers, server-sent events, the request and response
models (`protocol/`), logprobs, tool calls, the body-size limit, the HTTP server and the CLI."""
