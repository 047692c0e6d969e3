variable "project_id" {
  description = "GCP project of the GKE cluster and the bucket."
  type        = string
}

variable "region" {
  description = "Region of the GKE cluster; the bucket goes there too."
  type        = string
  default     = "us-central1"
}

variable "bucket_name" {
  description = "Name of the checkpoint bucket (globally unique)."
  type        = string
}

variable "delete_checkpoints_after_days" {
  description = "Optional age-based deletion of checkpoints (null: keep)."
  type        = number
  default     = null
}
