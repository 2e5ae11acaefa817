"""Integrations with other libraries (tools above the core): Hugging Face Trainer / TRL / PEFT."""
