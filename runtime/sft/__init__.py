"""Supervised fine-tuning: chat records, chat templates with assistant-only loss masks, packed training rows."""
