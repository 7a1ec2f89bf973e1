"""Stage server: one pipeline stage behind POST /forward and POST /backward."""
