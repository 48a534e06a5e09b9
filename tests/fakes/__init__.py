"""Local stand-ins for external services that tests drive real clients against."""
