"""The panes and dialogs of the console."""
