# The longrun service: API server, worker and migrations (docker-compose.yml runs them on PostgreSQL).
#
#   docker build -t longrun .                                   # the service alone: no torch (~150 MB of packages)
#   docker build -t longrun-worker --build-arg EXTRAS=postgres,trainer .
#                                                               # + torch (CPU build) and the trainer, so that the
#                                                               # worker's `local` host can run the bundled trainer
#
# GPU hosts reached over SSH need their own Python with `pip install "longrun[trainer]"`, not this image.
FROM python:3.11-slim
ARG EXTRAS=postgres
# torch's CPU wheels: the default index would bring the CUDA build and several GB of nvidia-* wheels
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN apt-get update && apt-get install -y --no-install-recommends openssh-client && rm -rf /var/lib/apt/lists/*
COPY . /src
RUN case ",${EXTRAS}," in *,trainer,*) pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch ;; esac
RUN pip install --no-cache-dir "/src[${EXTRAS}]"
ENV LONGRUN_HOME=/data
WORKDIR /data
EXPOSE 8080
CMD ["longrun", "serve"]
