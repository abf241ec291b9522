"""Top-level routes: the API under ``/v1``, the admin (and its dashboard) under ``/admin``."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/dashboard/", include("coordination.dashboard.urls")),
    path("admin/", admin.site.urls),
    path("v1/", include("coordination.api.urls")),
]

handler400 = "coordination.api.errors.json_bad_request"
handler404 = "coordination.api.errors.json_not_found"
handler500 = "coordination.api.errors.json_server_error"
