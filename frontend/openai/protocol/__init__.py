"""The OpenAI-compatible request and response models (pydantic), one module per endpoint."""
