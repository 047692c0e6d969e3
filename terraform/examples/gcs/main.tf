# A GCS checkpoint bucket and a Workload Identity service account for a GKE cluster
# (Workload Identity enabled on the cluster and its GPU node pool).
#   terraform init && terraform apply -var project_id=my-project -var bucket_name=acme-ml-checkpoints
terraform {
  required_version = ">= 1.5"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 5.20, < 8.0"
    }
  }
}

provider "google" {
  project = var.project_id
  region  = var.region
}

module "checkpoints" {
  source = "../../modules/gcs-checkpoints"

  project_id                    = var.project_id
  bucket_name                   = var.bucket_name
  location                      = var.region
  checkpoint_prefix             = "checkpoints/"
  delete_checkpoints_after_days = var.delete_checkpoints_after_days
  namespace                     = "ml-training"
  kubernetes_service_account    = "cloudckpt-trainer"
  labels                        = { "app" = "cloudckpt" }
}
