"""Images: decoding and checking request images, and the vision encoder that turns them into embeddings."""
