"""Small widgets of the pdtrace TUI, each with its own DEFAULT_CSS."""
