"""The only package that imports pyfuse3: thin handlers over the service."""
