"""The HTTP gateway: OpenAI-compatible routes over shared/client.py. Never imports torch or
engine/."""
