"""Operations endpoints: liveness, readiness and Prometheus metrics."""
