"""Core of kvbridge."""
