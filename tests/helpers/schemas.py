"""JSON schemas the structured-output tests hold generations to."""

# A scientist: bounded strings (where grammar masks cost the most), an integer range, an array
# with item bounds, no extra keys. A small model fills it in a few dozen tokens.
SCIENTIST = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
                   "fields": {"type": "array", "items": {"type": "string", "maxLength": 20},
                              "minItems": 1, "maxItems": 3}},
    "required": ["name", "born", "fields"],
    "additionalProperties": False,
}
