"""Supervised fine-tuning: chat records tokenized with assistant-only loss masks into packed training rows (the
records and chat templates themselves are runtime/schema's records.py and chat.py, which a launch checks with)."""
