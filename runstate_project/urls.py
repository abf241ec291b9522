"""Top-level routes: the API under ``/v1``, the admin (and its dashboard) under ``/admin``."""

from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView

from coordination.api.errors import json_not_found

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/dashboard/", include("coordination.dashboard.urls")),
    path("admin/", admin.site.urls),
    path("v1/", include("coordination.api.urls")),
    # Last: any other path under /v1 is the API's NOT_FOUND envelope, also while DEBUG is on
    # (when Django would answer its HTML page listing every route instead of handler404).
    re_path(r"^v1(?:/.*)?$", json_not_found, name="api-not-found"),
]

handler400 = "coordination.api.errors.json_bad_request"
handler404 = "coordination.api.errors.json_not_found"
handler500 = "coordination.api.errors.json_server_error"
