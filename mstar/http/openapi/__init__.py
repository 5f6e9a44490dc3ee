"""`/openapi.json`: the OpenAPI 3.1 document of every route, its request
schemas and its response schemas."""
