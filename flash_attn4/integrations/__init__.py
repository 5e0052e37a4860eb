"""Integrations with other libraries (imported lazily: flash_attn4 itself does not need them)."""
