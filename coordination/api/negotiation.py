"""Content negotiation for views whose answer has one fixed shape whatever the client accepts."""

from rest_framework.negotiation import BaseContentNegotiation


class FirstRenderer(BaseContentNegotiation):
    """Answer with the view's first renderer, whatever the ``Accept`` header says.

    For views that produce their own body (Prometheus text, an event stream): a client
    accepting only that type (a scraper, a browser's ``EventSource``) must still get the
    view's answer, and its errors, rather than ``406``.
    """

    def select_parser(self, request, parsers):  # noqa: D102
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):  # noqa: D102
        return renderers[0], renderers[0].media_type
