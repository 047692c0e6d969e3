variable "region" {
  description = "AWS region of the EKS cluster and the bucket."
  type        = string
  default     = "us-east-1"
}

variable "cluster_name" {
  description = "Name of the EKS cluster whose pods write checkpoints."
  type        = string
}

variable "bucket_name" {
  description = "Name of the checkpoint bucket (globally unique)."
  type        = string
}

variable "kms_key_arn" {
  description = "Optional customer-managed KMS key (null: SSE-S3)."
  type        = string
  default     = null
}

variable "expire_checkpoints_after_days" {
  description = "Optional age-based deletion of checkpoints (null: keep)."
  type        = number
  default     = null
}
