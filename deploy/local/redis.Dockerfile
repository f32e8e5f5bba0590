# Redis for deploy/docker-compose.local.yml where the official image cannot be pulled: Debian's redis-server
# (7.0) on the local Debian base. Like the official image it works in /data and turns protected mode off (the
# compose network, not a password, keeps it private), so the compose file's command and health check run as
# they are.
ARG BASE_IMAGE=local/debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data \
 && printf '#!/bin/sh\nif [ "$1" = redis-server ]; then shift; exec redis-server --protected-mode no "$@"; fi\nexec "$@"\n' \
      > /usr/local/bin/redis-entrypoint && chmod +x /usr/local/bin/redis-entrypoint
WORKDIR /data
USER redis
EXPOSE 6379
ENTRYPOINT ["redis-entrypoint"]
CMD ["redis-server"]
