# MLflow tracking server with the PostgreSQL driver, the S3 client and the basic-auth app (infra/compose.yaml builds it).
#   docker build -f infra/mlflow.Dockerfile -t raypai-mlflow infra/
FROM python:3.11-slim
ARG MLFLOW_VERSION=3.17.2
RUN pip install --no-cache-dir "mlflow[auth]==${MLFLOW_VERSION}" "psycopg[binary]>=3.1" "boto3>=1.34"
EXPOSE 5000
CMD ["mlflow", "server", "--host=0.0.0.0", "--port=5000"]
