"""Uploaded files: storage (local directory or S3), processing into chunks, retrieval into turns.

Kept free of imports: the file reader's child process (reader.py) imports this package too."""
