"""`specdecode serve`: OpenAI-compatible routes over the engine's decoding loop."""
