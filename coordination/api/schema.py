"""OpenAPI extensions: how drf-spectacular describes runstate's authentication."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Describe ``ApiKeyAuthentication`` as an HTTP bearer scheme."""

    target_class = "coordination.api.auth.ApiKeyAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        """Return the security scheme object."""
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key: `Authorization: Bearer rs_<prefix>_<secret>`.",
        }
