"""Routes of the dashboard, under ``/admin/dashboard/`` (before the admin's own routes)."""

from django.contrib import admin
from django.urls import path

from coordination.dashboard import views

urlpatterns = [
    path("", admin.site.admin_view(views.dashboard), name="runstate-dashboard"),
    path("panels", admin.site.admin_view(views.panels), name="runstate-dashboard-panels"),
    path("stream", views.stream, name="runstate-dashboard-stream"),
]
