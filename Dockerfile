# The longrun service: API server, worker and migrations (docker-compose.yml runs them on PostgreSQL).
# No torch here: the service drives GPU hosts over SSH and never imports the trainer; the hosts need
# Python with `pip install "longrun[trainer]"`, not this image.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends openssh-client && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN pip install --no-cache-dir "/src[postgres]"
ENV LONGRUN_HOME=/data
WORKDIR /data
EXPOSE 8080
CMD ["longrun", "serve"]
