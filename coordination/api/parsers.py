"""Request parsing that answers hostile input with a 4xx instead of crashing."""

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class SafeJSONParser(JSONParser):
    """JSON parsing that refuses pathologically nested documents with a 400."""

    def parse(self, stream, media_type=None, parser_context=None):
        """Parse the body; nesting deep enough to exhaust the stack is a ``ParseError``."""
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON nested too deeply.") from None
