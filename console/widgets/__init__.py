"""Reusable widgets of the console (charts, log view, form fields)."""
