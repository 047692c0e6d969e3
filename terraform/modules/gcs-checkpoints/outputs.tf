output "bucket_name" {
  description = "The checkpoint bucket's name."
  value       = google_storage_bucket.this.name
}

output "bucket_url" {
  description = "The checkpoint bucket's gs:// URL."
  value       = google_storage_bucket.this.url
}

output "checkpoint_uri_prefix" {
  description = "Run URIs start with this: put gs://<bucket>/<prefix><run> in the training config's cloudckpt.uri."
  value       = "gs://${google_storage_bucket.this.name}/${var.checkpoint_prefix}"
}

output "service_account_email" {
  description = "Annotate the Kubernetes service account with it: iam.gke.io/gcp-service-account."
  value       = google_service_account.trainer.email
}

output "role" {
  description = "The role granted on the bucket."
  value       = google_storage_bucket_iam_member.trainer.role
}
