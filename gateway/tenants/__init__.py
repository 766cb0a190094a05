"""Tenants: the organisations whose applications call models through the gateway."""
