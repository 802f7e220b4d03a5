"""Saving and restoring: the Saver, restore planning, asynchronous saves, staging, readers."""
