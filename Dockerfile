# The longrun service (API + worker). GPU hosts need only Python with torch and the trainer.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends openssh-client && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir -e ".[postgres,trainer]"
ENV LONGRUN_HOME=/data LONGRUN_BIND_HOST=0.0.0.0
EXPOSE 8080
CMD ["longrun", "serve"]
