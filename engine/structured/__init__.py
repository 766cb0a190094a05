"""Structured output and tool calling: grammars (llguidance) and tool-call formats."""
